"""What every API shares (choice deltas, streams, errors, tools, reasoning); it imports no API."""
