"""Where the recipe launcher takes its model from (``hf_perf_callbacks.train.build``): ``--model_name_or_path
packaged`` trains the packaged SmolLM2-135M-Instruct, and a hub id the machine cannot download fails at once, in one
line, without the hub client's retries (CPU, offline)."""
from __future__ import annotations

import logging
import socket

import pytest

from hf_perf_callbacks import real_model, train
from hf_perf_callbacks.train import build
from tests import test_recipes

# the recipe tests' fixtures and recipe writer, shared
launcher_process, nothing_heavy, tiny_model = (test_recipes.launcher_process, test_recipes.nothing_heavy,
                                               test_recipes.tiny_model)
write_recipe = test_recipes.write_recipe


@pytest.fixture
def no_offline_flag(monkeypatch):
    """The hub switched on for this process, as on a newcomer's machine (the tests set HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def closed_endpoint(monkeypatch):
    """The hub's endpoint at a local port nothing listens on: a connection is refused at once."""
    from huggingface_hub import constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")


def spy_tokenizer_loads(monkeypatch) -> list[dict]:
    """Every ``AutoTokenizer.from_pretrained`` call's name and keyword arguments, the call itself unchanged."""
    from transformers import AutoTokenizer

    calls: list[dict] = []
    load = AutoTokenizer.from_pretrained

    def spy(name, *args, **kwargs):
        calls.append({"name": name, **kwargs})
        return load(name, *args, **kwargs)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    return calls


def test_an_unreachable_hub_loads_from_this_machine_only_and_fails_in_one_line(
        tmp_path, capsys, monkeypatch, nothing_heavy, launcher_process, no_offline_flag, closed_endpoint):
    """No offline flag, and the hub out of reach: the launcher probes once, loads with ``local_files_only`` (no
    retries), and a model that is not in the cache ends as one line with exit 2, naming ``packaged``."""
    calls = spy_tokenizer_loads(monkeypatch)
    model = "someone/not-cached-model"
    assert train.main(["--config", write_recipe(tmp_path), "--use_cpu", "true", "--model_name_or_path", model,
                       "--callbacks", "none", "--output_dir", str(tmp_path / "o")]) == 2
    assert [(c["name"], c["local_files_only"]) for c in calls] == [(model, True)]
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "the hub cannot be reached from this machine" in line and build.PACKAGED_MODEL in line


def test_a_reachable_hub_or_a_local_folder_is_loaded_as_before(tiny_model, monkeypatch, no_offline_flag):
    """A local folder is never probed; a reachable endpoint leaves the hub client in charge; behind a proxy nothing
    is probed (the hub's client goes through it)."""
    from types import SimpleNamespace

    probes: list[tuple] = []

    class Connection:
        def close(self):
            pass

    monkeypatch.setattr(socket, "create_connection", lambda address, timeout: probes.append(address) or Connection())
    assert build.resolve_model(SimpleNamespace(model_name_or_path=tiny_model)) is False and probes == []
    assert build.resolve_model(SimpleNamespace(model_name_or_path="org/model")) is False and len(probes) == 1
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert build.hub_unreachable() is False and len(probes) == 1


def test_packaged_trains_the_packaged_model(tiny_model, tmp_path, monkeypatch, caplog, launcher_process):
    """``--model_name_or_path packaged`` loads the folder ``smollm2_path()`` gives (here the tests' tiny model in its
    place) for the tokenizer and the model, and says so in one line."""
    monkeypatch.setattr(real_model, "smollm2_path", lambda: tiny_model)
    calls = spy_tokenizer_loads(monkeypatch)
    out = tmp_path / "o"
    with caplog.at_level(logging.INFO, logger="hf_perf_callbacks"):
        assert train.main(["--config", write_recipe(tmp_path), "--use_cpu", "true", "--model_name_or_path",
                           build.PACKAGED, "--callbacks", "none", "--report", "false", "--max_steps", "1",
                           "--output_dir", str(out)]) == 0
    assert [c["name"] for c in calls] == [tiny_model]
    assert (out / "config.json").exists() or (out / "adapter_config.json").exists()
    assert [r for r in caplog.records if f"model_name_or_path={build.PACKAGED}" in r.getMessage()]


def test_packaged_without_its_package_is_one_line(tmp_path, capsys, monkeypatch, nothing_heavy, launcher_process):
    def missing():
        raise real_model.MissingModelPackage(f"run `{real_model.INSTALL}`")
    monkeypatch.setattr(real_model, "smollm2_path", missing)
    assert train.main(["--config", write_recipe(tmp_path), "--use_cpu", "true", "--model_name_or_path",
                       build.PACKAGED, "--callbacks", "none", "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and real_model.INSTALL in err
