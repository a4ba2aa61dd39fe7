"""The web toolkit both servers are built with (the sandbox runtime and the rollout service), neutral to both:
the aiohttp app's answers and middleware (webapp), the one table that routes, validates and describes an API in
OpenAPI (openapi), the front door's connection limits (connections), the listening address and the exposure rule
(address), and the command line's start-up conventions (cli). It imports nothing of the project."""
