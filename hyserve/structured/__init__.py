"""Structured outputs: what a request constrains (`StructuredSpec`, plain data the server builds), the
xgrammar grammars of the K3 and K2 chat formats, and the compiled matchers the engine masks logits with
(docs/ARCHITECTURE.md, "Structured outputs")."""
