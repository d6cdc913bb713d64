"""The HTTP routes, a Litestar controller per resource. Each handler checks its request, runs it
on the engine through `Serving` (given by dependency injection as `serving`), and hands the
outputs to a reply mapper (server/replies/)."""
