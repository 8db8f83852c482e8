"""CLI: python -m qerl_jax.train --config configs/X.py[:ARG] [--config.FIELD=VALUE ...]
--workdir DIR [--resume [--restart]] [--overwrite] [--allow_config_change] [--debug]

Thin: reads the config file and its overrides, validates the whole config and the data (no
JAX is imported for that, so a bad field fails in about a second), then hands them to the
Trainer. `--help` lists every config field with its default and description.

Nothing an earlier run wrote is lost on a refused or failed start: every input (config, data,
model files, run directory) is checked before the run directory changes, and --overwrite moves
the earlier run's files into WORKDIR/replaced-<UTC time>/.

Exit status: 0 done; 2 a bad input (config field, override, config file, data file or row,
model file, run directory) or a file that cannot be written (a full disk), printed as one line
`error: ...` naming it (the traceback only with --debug); a stopped run's
TrainingStopped.exit_code; 130 interrupted.
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import traceback

import ml_collections
from absl import flags
from ml_collections import config_flags

from qerl_jax.config_checks import suggest_field
from qerl_jax.experiment_config import (FIELDS, MAPPING_FIELDS, base_config, config_leaves,
                                      validate_config)
from qerl_jax.tasks import load_eval_examples, load_training_examples
from qerl_jax.infra.errors import EXIT_BAD_INPUT, ConfigError, TrainingStopped

EXIT_INTERRUPTED = 130
USAGE = ("usage: python -m qerl_jax.train --config FILE[:ARG] --workdir DIR "
         "[--config.FIELD=VALUE ...] [--resume [--restart]] [--overwrite] "
         "[--allow_config_change] [--debug]")
# name -> (kind, help); the config flag is defined by ml_collections.config_flags
CLI_FLAGS = {
    "config": ("file", "Experiment config file (configs/*.py) defining get_config(); ':ARG' is "
                       "passed to it (e.g. configs/qerl.py:7b,gsm8k)."),
    "config.FIELD": ("value", "Overrides one config field (listed below), parsed as the "
                              "field's type (e.g. --config.train.learning_rate=1e-3)."),
    "workdir": ("string", "Run directory: metrics.jsonl, checkpoints, run.json, plots."),
    "resume": ("bool", "Continue from the last checkpoint in --workdir (an intact checkpoint "
                       "that does not fit the config is refused, never moved)."),
    "restart": ("bool", "With --resume: when --workdir holds no checkpoint but an earlier "
                        "run's metrics or moved-aside checkpoints, start over at step 0, those "
                        "files moved into WORKDIR/replaced-<UTC time>/ (without it such a "
                        "resume is refused)."),
    "overwrite": ("bool", "A fresh run into a --workdir holding an earlier run's files moves "
                          "them into WORKDIR/replaced-<UTC time>/ (the warm-up cache stays), "
                          "once every input is checked."),
    "allow_config_change": ("bool", "With --resume: accept a config whose training-relevant "
                                    "fields differ from the earlier run's."),
    "debug": ("bool", "Show the traceback of a bad-input error."),
}
_HELP_FLAGS = ("--help", "-h", "-help", "--helpshort", "--helpfull", "-?")


class UsageError(Exception):
    """A command line the CLI cannot read (exit 2, like a ConfigError)."""


# ----------------------------------------------------------------------------- parsing
def _config_argument(argv: list[str]) -> str | None:
    """The value of --config (either '--config=X' or '--config X'), or None."""
    for index, arg in enumerate(argv):
        name, equals, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-") or name != "config":
            continue
        if equals:
            return value
        return argv[index + 1] if index + 1 < len(argv) else None
    return None


def _override_paths(argv: list[str]) -> list[str]:
    """The FIELD of each --config.FIELD[=VALUE] argument."""
    return [arg.lstrip("-").partition("=")[0][len("config."):] for arg in argv
            if arg.startswith("-") and arg.lstrip("-").startswith("config.")]


def _file_error_line(error: BaseException, path: str) -> str:
    """'FILE:LINE: Type: message' of an exception raised while loading the config file."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}: SyntaxError: {error.msg}"
    target = os.path.abspath(path)
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
             if os.path.abspath(frame.filename) == target]
    where = f"{path}:{lines[-1]}" if lines else path
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{where}: {type(error).__name__}: {message}"


def _original_error(error: BaseException) -> BaseException:
    """The first exception of the chain behind `error`: absl wraps a flag parser's exception,
    and config_flags re-raises get_config's TypeError / ValueError with a traceback text."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return error


def _parse(argv: list[str], config_value: str, with_overrides: bool):
    """absl's parse of the command line, without the --config.* overrides and other flags
    unless asked: the flag values.

    Raises:
      UsageError: one line naming the flag, or the config file's line that raised.
    """
    path = config_value.split(":", 1)[0]
    if not os.path.isfile(path):
        raise UsageError(f"--config {path}: no such file")
    if not with_overrides:
        argv = [argv[0], f"--config={config_value}"]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, CLI_FLAGS["config"][1],
                                    flag_values=flag_values, lock_config=True, sys_argv=argv)
    flags.DEFINE_string("workdir", None, CLI_FLAGS["workdir"][1], flag_values=flag_values)
    for name, (kind, description) in CLI_FLAGS.items():
        if kind == "bool":
            flags.DEFINE_bool(name, False, description, flag_values=flag_values)
    # our own line below says what config_flags' warnings say (e.g. get_config returned None)
    absl_logger = logging.getLogger("absl")
    absl_level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        rest = flag_values(argv)
        if flag_values.config is not None:
            flag_values.config.keys   # a file that failed to load raises only when read
    except ConfigError:   # raised by the config file's code (e.g. a bad ':ARG')
        raise
    except flags.Error as error:
        original = _original_error(error)
        if str(error).startswith("flag --config=") and original is not error:
            if isinstance(original, ConfigError):
                raise original from None
            raise UsageError(_file_error_line(original, path)) from error
        raise UsageError(str(error).strip().splitlines()[0]) from error
    except Exception as error:   # the config file failed to load or raised
        raise UsageError(_file_error_line(error, path)) from error
    finally:
        absl_logger.setLevel(absl_level)
    if not isinstance(flag_values.config, ml_collections.ConfigDict):
        raise UsageError(f"{path}: get_config() returned {flag_values.config!r}, expected an "
                         "ml_collections.ConfigDict")
    if len(rest) > 1:
        raise UsageError(f"unexpected argument {rest[1]!r} (flags are --name=value)")
    return flag_values


def _check_override_paths(argv: list[str], config, config_file: str) -> None:
    """Refuses a --config.FIELD that the config lacks (config_flags says only KeyError), with
    the closest field as a suggestion."""
    known = config_leaves(config, mapping_fields=())
    sections = {path.rsplit(".", 1)[0] for path in known if "." in path}
    for path in _override_paths(argv[1:]):
        if path in known:
            continue
        if path in sections:
            raise ConfigError(f"config.{path}: a section; override its fields "
                              f"(--config.{path}.NAME=VALUE)")
        hint = suggest_field(path, list(known) + list(FIELDS))
        mapping = next((name for name in MAPPING_FIELDS if path.startswith(name + ".")), None)
        if mapping is not None:
            raise ConfigError(f"config.{path}: not a key of {config_file}'s config.{mapping}; "
                              "an override changes a key the config file sets (add new keys "
                              "there)" + hint)
        raise ConfigError(f"config.{path}: unknown field" + hint)


def parse_command_line(argv: list[str]):
    """(config, flag values) of a command line; the config is not validated yet.

    Raises:
      UsageError, ConfigError: one line naming the flag, field or file.
    """
    config_value = _config_argument(argv[1:])
    if not config_value:
        raise UsageError("--config is required, e.g. --config configs/tiny.py (python -m "
                         "qerl_jax.train --help)")
    loaded = _parse(argv, config_value, with_overrides=False).config
    _check_override_paths(argv, loaded, config_value.split(":", 1)[0])
    flag_values = _parse(argv, config_value, with_overrides=True)
    if not flag_values.workdir:
        raise UsageError("--workdir is required (python -m qerl_jax.train --help)")
    return flag_values.config, flag_values


def apply_overrides(config, overrides: list[str], source: str):
    """`config` with the `overrides` (--config.FIELD=VALUE arguments) applied in place (and
    returned), each checked and parsed as the command line's (the field's type); `source` names
    the config in messages.

    Raises:
      UsageError, ConfigError: one line naming the flag or field.
    """
    _check_override_paths(["", *overrides], config, source)
    flag_values = flags.FlagValues()
    argv = ["", *overrides]
    config_flags.DEFINE_config_dict("config", config, flag_values=flag_values, lock_config=True,
                                    sys_argv=argv)
    try:
        flag_values(argv)
    except flags.Error as error:
        raise UsageError(str(error).strip().splitlines()[0]) from error
    return flag_values.config


# ----------------------------------------------------------------------------- help
def help_text(argv: list[str]) -> str:
    """The usage, the flags and every config field with its value and description: the file's
    values when --config names a loadable file, else the defaults of base_config()."""
    config, source = base_config(), "defaults of qerl_jax.experiment_config.base_config()"
    config_value = _config_argument(argv[1:])
    if config_value:
        try:
            config = _parse(argv, config_value, with_overrides=False).config
            source = f"values of {config_value}"
        except Exception as error:   # the help still lists the defaults
            source += f"; {config_value} did not load: {error}"
    values = config_leaves(config)
    lines = [USAGE, "", "flags:"]
    for name, (kind, description) in CLI_FLAGS.items():
        lines.append(f"  --{name}" + ("" if kind == "bool" else f"={kind.upper()}"))
        lines.append(textwrap.indent(textwrap.fill(description, 92), " " * 6))
    lines += ["", f"config fields ({source}):"]
    for path, field in FIELDS.items():
        value = values.get(path, field.default)
        value = dict(value) if path == "model.overrides" else value
        lines.append(f"  config.{path}={value!r}")
        lines.append(textwrap.indent(textwrap.fill(field.description, 92), " " * 6))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def _configure_logging() -> None:
    """INFO from qerl_jax, WARNING from everything else (absl and orbax log every save at
    INFO); transformers' advisories (e.g. 'PyTorch was not found') are silenced."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("qerl_jax").setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)


def _report_error(message: str, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit status."""
    argv = list(sys.argv if argv is None else argv)
    if any(arg in _HELP_FLAGS or arg.startswith("--help=") for arg in argv[1:]):
        print(help_text(argv))
        return 0
    debug = any(arg in ("--debug", "-debug", "--debug=true", "--debug=True")
                for arg in argv[1:])
    try:
        config, flag_values = parse_command_line(argv)
        validate_config(config)
        load_eval_examples(config, load_training_examples(config))
    except (UsageError, ConfigError) as error:
        _report_error(str(error), debug)
        return EXIT_BAD_INPUT
    _configure_logging()
    try:
        from qerl_jax.trainer import Trainer   # imports JAX: after every input is checked
        trainer = Trainer(config, os.path.abspath(flag_values.workdir),
                          resume=flag_values.resume, overwrite=flag_values.overwrite,
                          allow_config_changes=flag_values.allow_config_change,
                          restart=flag_values.restart)
        trainer.train()
        from qerl_jax.infra.metrics import METRICS_FILE, read_metrics, run_summary
        metrics_path = os.path.join(flag_values.workdir, METRICS_FILE)
        summary = (run_summary(read_metrics(flag_values.workdir))
                   if os.path.isfile(metrics_path) else None)
    except ConfigError as error:
        _report_error(str(error), debug)
        return EXIT_BAD_INPUT
    except TrainingStopped as error:   # StorageError (exit 2) included
        if debug:
            traceback.print_exc()
        prefix = "error: " if error.exit_code == EXIT_BAD_INPUT else ""
        print(prefix + str(error).replace("\n", " "), file=sys.stderr)
        return error.exit_code
    except OSError as error:   # a file's failure: one line naming it
        if isinstance(error, FileNotFoundError) and error.filename is None:
            _report_error(str(error), debug)   # the loaders' message names the path
            return EXIT_BAD_INPUT
        if error.filename is None:   # not a file's: the platform's, with its traceback
            raise
        reason = error.strerror or str(error)
        _report_error(f"{error.filename}: {reason[:1].lower() + reason[1:]}", debug)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if summary:   # the whole run's, a resumed one's too
        print(f"{summary}; metrics in {metrics_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
