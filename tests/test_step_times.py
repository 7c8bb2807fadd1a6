"""Engine steps counted by how they ran (`engine/step_times.py`), on /metrics and in the replay's step mix."""

from hyserve import SamplingParams
from hyserve.bench.prometheus import parse_counters, step_mix
from hyserve.engine.step_times import StepTimes
from hyserve.metrics import ServerMetrics


def test_a_step_is_timed_from_the_later_of_its_launch_and_the_landing_before_it():
    t = StepTimes()
    t.landed("eager", 100, launched=1.0, now=1.5)  # nothing landed before: from its launch
    t.landed("graph", 4, launched=1.2, now=1.7)  # launched while the first ran: from the first's landing
    t.landed("graph", 4, launched=3.0, now=3.1)  # the engine was idle from 1.7 to 3.0: not counted
    assert t.steps == {"eager": 1, "graph": 2} and t.tokens == {"eager": 100, "graph": 8}
    assert abs(t.seconds["eager"] - 0.5) < 1e-9 and abs(t.seconds["graph"] - 0.3) < 1e-9


def test_engine_counts_prefill_steps_as_eager_and_graph_decodes_as_graph(make_engine):
    engine = make_engine(static_decode_buffers=True)
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    steps = engine.stats.steps
    assert steps.steps["eager"] >= 1 and steps.tokens["eager"] >= 4  # the prompt (its last token may ride alone)
    assert steps.steps["graph"] >= 4  # the decodes replay the graphs' static buffers
    assert sum(steps.tokens.values()) >= 5 + 5
    assert all(v >= 0 for v in steps.seconds.values())


def test_step_counters_on_metrics_carry_a_kind_label_the_bench_parser_keeps():
    times = StepTimes({"eager": 2, "graph": 10}, {"eager": 300, "graph": 40}, {"eager": 0.2, "graph": 0.1})
    text = ServerMetrics("m", lambda: {"steps": vars(times)}).render().decode()
    assert 'hyserve:engine_steps_total{engine="0",kind="graph",model_name="m"} 10.0' in text
    after = parse_counters(text)
    assert after["hyserve:engine_steps"] == 12 and after["hyserve:engine_step_seconds[eager]"] == 0.2
    before = parse_counters(ServerMetrics("m", lambda: {"steps": vars(StepTimes())}).render().decode())
    mix = step_mix(before, after, window_s=1.0)
    assert mix["eager"] == {"steps_per_s": 2.0, "ms_per_step": 100.0, "tokens_per_step": 150.0, "busy_share": 0.2}
    assert mix["graph"]["ms_per_step"] == 10.0 and mix["graph"]["tokens_per_step"] == 4.0


def test_no_step_mix_without_the_counters():
    assert step_mix(None, {"hyserve:engine_steps[graph]": 1.0}, 1.0) is None
    assert step_mix({}, {"vllm:generation_tokens": 5.0}, 1.0) is None
