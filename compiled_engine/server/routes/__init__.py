"""The app's own routes beside the APIs': health, metrics, the prefix cache, the chat and docs pages."""
