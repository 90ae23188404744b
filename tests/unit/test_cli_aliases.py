"""SGLang's `--model-path` names the model wherever our tools take `--model` (and the reverse for the
engine-step tools), so commands copied from either project's docs run."""

from __future__ import annotations

import argparse

import pytest

from runtime.cli import build_parser, config_from_args


@pytest.mark.parametrize("command", [["serve"], ["generate", "hello"]])
def test_model_path_parses_to_the_same_config_as_model(command) -> None:
    flags = ["--load-format", "dummy"]
    by_model = config_from_args(build_parser().parse_args([*command, "--model", "llama-3.1-8b", *flags]))
    by_path = config_from_args(build_parser().parse_args([*command, "--model-path", "llama-3.1-8b", *flags]))
    assert by_path == by_model
    assert by_path.model == "llama-3.1-8b"


class _Parsed(Exception):
    pass


def test_the_engine_step_tools_take_model_as_well_as_model_path(monkeypatch) -> None:
    pytest.importorskip("torch")
    from loadgen import layer_times, steps

    p = argparse.ArgumentParser()
    steps.add_args(p)
    assert p.parse_args(["--model", "llama-3.1-8b"]) == p.parse_args(["--model-path", "llama-3.1-8b"])

    def stop(model_path, **kwargs):  # the first use of the parsed flags: stop before any model is built
        raise _Parsed(model_path)

    monkeypatch.setattr(layer_times, "RunnerConfig", stop)
    for flag in ("--model", "--model-path"):
        with pytest.raises(_Parsed, match="deepseek-v4-flash"):
            layer_times.main([flag, "deepseek-v4-flash", "--device", "cpu"])
