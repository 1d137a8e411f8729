// Replaced by the UCX engine.
