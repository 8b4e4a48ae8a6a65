"""SlimGCConfig: sources, precedence and clear errors for bad options."""
import pytest

from slimgc_mx.engine.config import SlimGCConfig


def test_defaults():
    cfg = SlimGCConfig.from_sources({}, environ={})
    assert (cfg.compressor, cfg.threshold, cfg.comm_threshold) == ("2bit", 0.5, "auto")
    assert cfg.backup and cfg.offload and cfg.fuse and cfg.audit_every == 0


def test_environment_then_options_precedence():
    env = {"SLIMGC_COMPRESSOR": "4bit", "SLIMGC_BACKUP": "off", "SLIMGC_COMM_THRESHOLD": "4096",
           "SLIMGC_NUM_THREADS": "2", "SLIMGC_TIMEOUT": "30", "SLIMGC_FUSE": "0"}
    cfg = SlimGCConfig.from_sources({"type": "1bit"}, environ=env)
    assert cfg.compressor == "1bit"  # compression_params beat the environment
    assert cfg.backup is False and cfg.comm_threshold == 4096 and cfg.fuse is False
    assert cfg.agreement_fields()["fuse"] is False  # every worker must build the same buckets
    assert cfg.num_threads == 2 and cfg.timeout == 30.0
    pieces = SlimGCConfig.from_sources({}, environ={"SLIMGC_PIECE_BYTES": "65536"})
    assert pieces.piece_bytes == 65536
    assert pieces.agreement_fields()["piece_bytes"] == 65536  # it names the wire keys


def test_trainer_compression_params_style():
    cfg = SlimGCConfig.from_sources({}, environ={}).replace(
        {"type": "2bit", "threshold": 0.25, "comm_threshold": "off", "offload": False})
    assert cfg.threshold == 0.25 and cfg.comm_threshold == "off" and cfg.offload is False
    assert SlimGCConfig().replace({"comm_threshold": 2048.0}).comm_threshold == 2048


@pytest.mark.parametrize("options, message", [
    ({"type": "3bit"}, "unknown compressor '3bit'; valid: "),
    ({"threshold": 0}, "threshold must be a positive finite number"),
    ({"threshold": float("nan")}, "threshold must be a positive finite number"),
    ({"threshold": float("inf")}, "threshold must be a positive finite number"),
    ({"comm_threshold": "sometimes"}, "expected 'auto', 'off', a size in bytes or the file of "
                                      "a saved CTTab decision"),
    ({"cttab_margin": -0.1}, "cttab_margin must be a number >= 0"),
    ({"cttab_margin": "a lot"}, "for option 'cttab_margin': expected a number"),
    ({"comm_threshold": -1}, "comm_threshold must be 'auto', 'off' or a non-negative size"),
    ({"warmup_steps": 1}, "warmup_steps must be an integer >= 2"),
    ({"cttab_rule": "paper"}, "unknown CTTab rule 'paper' (option cttab_rule); valid: fit, measured"),
    ({"num_threads": 0}, "num_threads must be an integer >= 1"),
    ({"loc_lr": -0.1}, "loc_lr must be a positive finite number"),
    ({"compresion": "2bit"}, "unknown SlimGC option 'compresion'; valid: type, compressor"),
    ({"backup": 1}, "backup must be True or False, got 1"),
    ({"offload": None}, "offload must be True or False, got None"),
    ({"fuse": [True]}, r"fuse must be True or False, got \[True\]"),
    ({"piece_bytes": 4}, "piece_bytes must be 0 (send buffers whole) or an integer >= 8"),
    ({"piece_bytes": 1.5}, "piece_bytes must be 0 (send buffers whole) or an integer >= 8"),
    ({"piece_bytes": "1MB"}, "for option 'piece_bytes': expected an integer number of bytes"),
])
def test_bad_options_name_the_problem(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SlimGCConfig.from_sources(options, environ={})


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match="backup must be True or False, got 'no'"):
        SlimGCConfig(backup="no")


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="SLIMGC_BACKUP"):
        SlimGCConfig.from_sources({}, environ={"SLIMGC_BACKUP": "maybe"})
    with pytest.raises(ValueError, match="SLIMGC_WARMUP_STEPS"):
        SlimGCConfig.from_sources({}, environ={"SLIMGC_WARMUP_STEPS": "ten"})


def test_a_misspelled_variable_is_warned_about_with_the_closest_name():
    with pytest.warns(UserWarning, match="SLIMGC_COMPRESOR is not a slimgc option and is "
                                         "ignored; did you mean SLIMGC_COMPRESSOR"):
        cfg = SlimGCConfig.from_sources({}, environ={"SLIMGC_COMPRESOR": "1bit"})
    assert cfg.compressor == "2bit"


def test_a_saved_decision_replays_and_workers_compare_what_it_holds(tmp_path):
    path = tmp_path / "decision.json"
    path.write_text('{"format": "slimgc-cttab-1", "best_ct": 163840, "rows": []}')
    cfg = SlimGCConfig.from_sources({}, environ={"SLIMGC_COMM_THRESHOLD": str(path)})
    assert cfg.comm_threshold == str(path)
    assert cfg.agreement_fields()["comm_threshold"] == "saved decision 163840"
