"""OpenAI's Responses API: routes, wire types, input turns, the stored responses, replies."""
