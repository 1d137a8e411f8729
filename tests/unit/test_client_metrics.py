"""The client's byte counters by direction: every put form counts as written, every get
form as read (a batch put once counted as read)."""

from mooncake_ray._private.metrics import ClientMetrics


def test_bytes_by_direction_for_single_and_batch_calls():
    m = ClientMetrics()
    m.observe("put", 0.001, 1, 10)
    m.observe("batch_put", 0.001, 4, 100)
    m.observe("get", 0.001, 1, 1000)
    m.observe("batch_get", 0.001, 4, 10000, tier="disk")
    with m._lock:
        assert m._bytes == {"write": 110, "read": 11000}
        assert m._ops == {"put": 1, "batch_put": 4, "get": 1, "batch_get": 4}
