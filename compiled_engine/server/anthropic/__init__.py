"""Anthropic's Messages API: routes, wire types, input turns, replies."""
