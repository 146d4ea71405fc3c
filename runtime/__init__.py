"""The tokenlane runtime: continuous-batching engine, model, HTTP server."""
