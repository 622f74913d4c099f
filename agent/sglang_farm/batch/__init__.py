"""The batch service, `sglang-farm-batch` (issue 33, docs/batch.md): OpenAI's Files and
Batches API in front of the farm, each request's state in a store, results exactly once.

Its own process (`main`), never imported by the agent. The modules, pure first:

- `validate`: an input file's lines -> requests, or every bad line named;
- `lifecycle`: the batch's status machine (validating -> ... -> completed);
- `requeststate`: one request's states and what an attempt's outcome makes of it;
- `retry`: an attempt's outcome classified (retry with back-off, or an error line);
- `capacity`: how many requests the farm can take now;
- `objects`: the OpenAI-shaped JSON of files, batches and output lines;
- `store`: the store's Protocol and rows; `sqlstore` the SQL both backends share,
  `sqlite` (embedded) and `postgres` (a queue several hosts share) the backends;
- `farmstatus`: the agent's status over its control socket (read-only);
- `runner`: claims requests and sends them through the front door;
- `api`: the HTTP routes (Starlette on uvicorn) and `/metrics`; `metrics` the registry;
- `main`: the composition root.
"""
