"""The HTTP routes, one router per API: admin (liveness, info, cache, metrics), native (SGLang's /generate),
openai (/v1). ``serve.api.create_app`` assembles them."""
