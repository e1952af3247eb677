"""What the services share: the FastAPI service base (`app`), settings, tokens (`auth`),
sealed boxes, the database, HTTP plumbing and clients, the OpenAI-compatible surface, and
the registry that declares the five services once."""
