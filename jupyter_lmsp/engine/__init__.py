"""Inference: an MLX worker process and the proxy the server process talks to it through.

The engine knows nothing of HTTP or the database. It receives `GenerateJob`s and answers with
the messages in `messages`; the task runner (services.runner) turns those into committed events.
"""
