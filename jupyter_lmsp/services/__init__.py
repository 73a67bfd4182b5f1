"""Services: the operations handlers call (no SQL, no MLX, no HTTP here).

`bus` fans committed events out to watchers, `follow` replays a task's log and then follows it
live, `runner` drives tasks through the engine, `responses` and `tasks` implement the endpoints'
operations, `catalog` resolves model ids to directories.
"""
