"""Serving layer: OpenAI-compatible HTTP API over the kvsparse engine (standalone or Ray Serve)."""
