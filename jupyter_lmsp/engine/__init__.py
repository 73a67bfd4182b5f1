"""Inference: an MLX worker process and the proxy the server process talks to it through.

The engine knows nothing of HTTP or the database. It receives `GenerateJob`s and answers with
the messages in `messages`; the task runner (services.runner) turns those into committed events.
"""

from . import transformers_index

# Before any engine module imports transformers (mlx-lm's tokenizer loader does): its index of
# model folders is read from a cache rather than rebuilt in each process (transformers_index).
transformers_index.install()
