import pytest

from mooncake_ray import ConfigError, StoreConfig, load_config, parse_size
from mooncake_ray.config import RdtConfig, load_rdt_config


@pytest.mark.parametrize("text,n", [("16gb", 16 << 30), ("512 MiB", 512 << 20), ("4k", 4096), ("1.5g", 3 << 29),
                                    (1024, 1024), ("100", 100), ("2TB", 2 << 40)])
def test_sizes(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "lots", "-1gb", "1.5.5g", True, [1]])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_mooncake_aliases_and_prefix_overrides():
    env = {
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "4gb",
        "MOONCAKE_LOCAL_BUFFER_SIZE": "128mb",
        "MOONCAKE_PROTOCOL": "TCP",
        "MOONCAKE_DEVICE": "eth0,eth1",
        "MOONCAKE_MASTER": "10.0.0.1:6379",
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "/nvme/spill",
        "MOONCAKE_USE_URING": "false",
        "MOONCAKE_RAY_MASTER__LEASE_TTL_S": "2.5",
        "MOONCAKE_RAY_TRANSPORT__UCX_OPTIONS": '{"RNDV_THRESH": "8k"}',
    }
    c = load_config({"segment_size_bytes": "1gb"}, environ=env)
    assert c.segment_size_bytes == 4 << 30  # environment wins over the file
    assert c.client.local_buffer_size_bytes == 128 << 20
    assert c.transport.protocol == "tcp" and c.transport.devices == ["eth0", "eth1"]
    assert c.ray_address == "10.0.0.1:6379"
    assert c.spill.enabled and c.spill.directory == "/nvme/spill" and not c.spill.use_uring
    assert c.master.lease_ttl_s == 2.5
    assert c.transport.ucx_options == {"RNDV_THRESH": "8k"}


def test_errors_name_field_value_and_allowed():
    with pytest.raises(ConfigError) as ei:
        load_config({"segment_size_bytes": "16zb", "transport": {"protocol": "ib"}, "master": {"high_watermark": 2},
                     "bogus": 1}, environ={})
    msg = str(ei.value)
    assert "segment_size_bytes: got '16zb'" in msg
    assert "transport.protocol: got 'ib'; allowed: 'auto', 'tcp', 'shm' or 'rdma'" in msg
    assert "master.high_watermark: got 2" in msg and "less than or equal to 1" in msg
    assert "bogus: got 1; unknown field" in msg
    assert isinstance(ei.value, ValueError)


def test_spill_needs_a_directory():
    with pytest.raises(ConfigError, match="spill.enabled is true but spill.directory is not set"):
        load_config({"spill": {"enabled": True}}, environ={})


def test_bad_env_value_names_the_field():
    with pytest.raises(ConfigError, match="master.node_ttl_s: got 'soon'"):
        load_config(None, environ={"MOONCAKE_RAY_MASTER__NODE_TTL_S": "soon"})


def test_file_and_model_inputs(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("segment_size_bytes: 2gb\nmaster:\n  replicas: 2\n")
    c = load_config(str(p), environ={})
    assert c.segment_size_bytes == 2 << 30 and c.master.replicas == 2
    assert load_config(c, environ={}) == c
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"), environ={})
    assert StoreConfig().namespace == "mooncake_ray"


def test_rdt_settings_from_arguments_environment_and_older_names():
    env = {"MOONCAKE_RDT_PROTOCOL": "TCP", "MOONCAKE_RDT_DEVICES": "", "MOONCAKE_RDT_RECV_POOL_BYTES": "512mb",
           "MOONCAKE_RDT_TIMEOUT_S": "30", "MOONCAKE_RAY_RDT__TIMEOUT_S": "45"}
    c = load_rdt_config(environ=env)
    assert (c.protocol, c.devices, c.recv_pool_bytes, c.timeout_s) == ("tcp", [], 512 << 20, 45.0)
    assert load_rdt_config({"devices": ["lo"], "timeout_s": 5}, environ=env).devices == ["lo"]
    assert load_rdt_config(environ={}) == RdtConfig() and RdtConfig().devices == ["lo"]
    assert load_config(None, environ=env) == load_config(None, environ={})  # not the store's
    with pytest.raises(ConfigError, match="protocol: got 'ib'"):
        load_rdt_config(environ={"MOONCAKE_RAY_RDT__PROTOCOL": "ib"})
