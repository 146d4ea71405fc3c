"""Command-line tools over the operator's builders: `tokenlane render` and `tokenlane check`."""
