"""The LMSP wire contract, at the bottom of the layers: pydantic models of every request body and
every object the service returns, their validation (and its errors), task states, event
builders, and the OpenAPI document generated from the models and the endpoints' operations.
It imports nothing else of the package."""
