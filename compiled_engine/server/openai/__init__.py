"""OpenAI's API and vLLM's additions: each route beside its reply mapper, over protocol.py."""
