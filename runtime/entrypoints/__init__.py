"""The HTTP server: the OpenAI-compatible FastAPI app, completions and chat, SSE, errors,
tenant and lane routing, and `tokenlane serve`."""
