"""MXNet's adapter: what the engine reaches of MXNet, through the backend protocol
(docs/backend.md). `framework.MXNetFramework` is the aggregator's side of it."""
