"""utils/safe_yaml.py: aliases, recursion, nesting and file size are bounded; ordinary YAML loads as before."""
from __future__ import annotations

import time

import pytest
import yaml

from utils.safe_yaml import YamlLimitError, expanded_size, load_yaml, read_yaml


def laughs(levels: int, width: int = 10) -> str:
    """A flow list whose last element expands to width**levels strings ("billion laughs")."""
    return "[&a0 [" + ", ".join(["x"] * width) + "]" + "".join(
        f", &a{k} [" + ", ".join([f"*a{k - 1}"] * width) + "]" for k in range(1, levels + 1)) + "]"


def test_alias_bomb_is_refused_quickly():
    start = time.perf_counter()
    with pytest.raises(YamlLimitError, match="more than 1,000,000 nodes"):
        load_yaml("names: " + laughs(9))
    assert time.perf_counter() - start < 1.0


def test_small_aliases_merge_keys_and_plain_documents_load_like_safe_load():
    text = "base: &base {lr: 0.1, momentum: 0.9}\nrun: {<<: *base, lr: 0.2}\nlist: &l [1, 2]\nagain: *l\n" + \
           "names: " + laughs(3)  # 1,000 strings once expanded: allowed
    assert load_yaml(text) == yaml.safe_load(text)
    assert expanded_size(yaml.compose("[a, [b, c]]")) == 5


def test_recursive_alias_and_deep_nesting_are_refused():
    with pytest.raises(YamlLimitError, match="recursive alias"):
        load_yaml("a: &a [1, *a]")
    with pytest.raises(YamlLimitError, match="nested too deeply"):
        load_yaml("[" * 20000 + "]" * 20000)


def test_tags_are_not_constructed():
    with pytest.raises(yaml.YAMLError):
        load_yaml("!!python/object/apply:os.system ['true']")


def test_file_size_limit(tmp_path, monkeypatch):
    import utils.safe_yaml as safe_yaml

    monkeypatch.setattr(safe_yaml, "MAX_YAML_BYTES", 100)
    path = tmp_path / "big.yaml"
    path.write_text("a: " + "b" * 200)
    with pytest.raises(YamlLimitError, match="larger than"):
        read_yaml(path)
    path.write_text("a: 1")
    assert read_yaml(path) == {"a": 1}
