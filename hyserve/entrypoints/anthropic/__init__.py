"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), served through the
same chat path as `/v1/chat/completions`: `protocol` holds the request models and the error shape,
`messages_input` turns a request into a chat request, `serving_messages` runs it and answers."""
