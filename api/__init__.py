"""metald's HTTP API (aiohttp): resources under /api/v1, problem+json errors, OpenAPI."""
