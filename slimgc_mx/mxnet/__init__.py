"""MXNet's adapter: the only modules of the package that import MXNet, reaching the
framework-free engine through the backend protocol (docs/backend.md). `kvstore.SlimGC` is
the store, `hooks` registers it, `framework.MXNetFramework` is the aggregator's side.
Importing this package alone imports nothing; its modules import MXNet."""
