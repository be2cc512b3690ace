import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from kvpool.config import config_from_dict, load_config, parse_size
from kvpool.configdoc import config_markdown, settings_models
from kvpool.errors import ConfigError


def test_defaults_are_valid() -> None:
    cfg = load_config(environ={})
    assert cfg.dram.capacity == 1 << 30
    assert cfg.ssd.durability == "cache"
    assert cfg.pool.prefetch_max_pending == 4 and cfg.pool.prefetch_batch == 8


@pytest.mark.parametrize(("text", "value"), [
    ("4GiB", 4 << 30), ("64MiB", 64 << 20), ("512KiB", 512 << 10), ("1GB", 10**9),
    ("65536", 65536), (4096, 4096), ("1.5GiB", 3 << 29),
])
def test_parse_size(text: object, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["4 parsecs", "-1", "", True, -5, "GiB"])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_yaml_then_env_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "kvpool.yaml"
    path.write_text("dram:\n  capacity: 2GiB\nssd:\n  durability: durable\n  io_threads: 2\n")
    env = {"KVPOOL_SSD__IO_THREADS": "8", "KVPOOL_DRAM__EVICTION": "lru", "OTHER": "x"}
    cfg = load_config(path, environ=env, overrides={"pool": {"ssd_write": "through"}})
    assert cfg.dram.capacity == 2 << 30
    assert cfg.ssd.durability == "durable"
    assert cfg.ssd.io_threads == 8
    assert cfg.dram.eviction == "lru"
    assert cfg.pool.ssd_write == "through"


def test_config_file_from_env(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("cache_dir: /somewhere\n")
    assert load_config(environ={"KVPOOL_CONFIG": str(path)}).cache_dir == "/somewhere"


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("dram:\n  capacityy: 1GiB\n")
    with pytest.raises(ConfigError, match=r"dram\.capacityy: unknown key"):
        load_config(path, environ={})
    with pytest.raises(ConfigError, match=r"ssd\.bogus: unknown key"):
        load_config(environ={"KVPOOL_SSD__BOGUS": "1"})
    with pytest.raises(ConfigError, match=r"colour: unknown key"):
        config_from_dict({"colour": "blue"})


def test_removed_pool_chunk_tokens_is_an_unknown_key() -> None:
    """pool.chunk_tokens was read by nothing (integrations take their chunk size from their
    own settings); a config that still sets it is refused like any unknown key."""
    with pytest.raises(ConfigError, match=r"pool\.chunk_tokens: unknown key"):
        config_from_dict({"pool": {"chunk_tokens": 256}})


@pytest.mark.parametrize(("data", "key"), [
    ({"dram": {"capacity": "lots"}}, "dram.capacity"),
    ({"ssd": {"durability": "sometimes"}}, "ssd.durability"),
    ({"ssd": {"io_threads": 0}}, "ssd.io_threads"),
    ({"dram": {"eviction": "random"}}, "dram.eviction"),
    ({"ssd": {"read_piece_bytes": "5KiB"}}, "ssd.read_piece_bytes"),
    ({"cluster": {"batch_bytes": 0}}, "cluster.batch_bytes"),
    ({"cluster": {"touch_threads": 0}}, "cluster.touch_threads"),
])
def test_bad_values_are_named(data: dict[str, dict[str, object]], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict(data)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("dram: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, environ={})
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar, environ={})


ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_md_is_what_the_models_generate() -> None:
    """docs/config.md is generated from the settings models (kvpool's and the vLLM
    connector's): a knob added, removed or changed without regenerating it fails here."""
    assert (ROOT / "docs" / "config.md").read_text() == config_markdown(), (
        "docs/config.md is stale: run `kvpool config --doc > docs/config.md`")


def test_every_knob_has_a_description() -> None:
    undocumented = [f"{prefix}{name}" for prefix, model in settings_models()
                    for name, field in model.model_fields.items()
                    if not (isinstance(field.annotation, type)
                            and issubclass(field.annotation, BaseModel))
                    and not (field.description or "").strip()]
    assert undocumented == []
    assert {prefix for prefix, _ in settings_models()} >= {
        "", "dram.", "ssd.", "pool.", "cluster.", "server.", "kv_connector_extra_config."}


def test_cli_doc_prints_the_generated_tables() -> None:
    res = subprocess.run([sys.executable, "-m", "kvpool.cli", "config", "--doc"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert res.stdout == config_markdown()
