"""Engine outputs to OpenAI replies: one stream of per-choice deltas (deltas.py), and a mapper per
reply shape over it (completions.py, chat.py)."""
