"""Packaging (pyproject.toml, requirements/lock-cpu.txt): the CUDA 12 and 13 extras, TensorBoard
event files from a plain install, every extra asked for in the installed dependency tree provided
under the name it is asked by (pip 23.2 warns otherwise), and a lock file that pins exactly the
dependency closure of qerl-jax[test] within pyproject's bounds."""

import os
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(ROOT, "requirements", "lock-cpu.txt")


@pytest.fixture(scope="module")
def project():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)["project"]


def _requirements(project, extras=()):
    texts = list(project["dependencies"])
    for extra in extras:
        texts += project["optional-dependencies"][extra]
    return [Requirement(text) for text in texts]


def _closure(requirements):
    """{canonical name: (installed distribution, extras asked of it)} over the installed
    dependency closure of `requirements` (markers evaluated here, with the extras asked)."""
    found, pending = {}, list(requirements)
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        known = found.get(name)
        fresh = set(requirement.extras) - (known[1] if known else set())
        if known and not fresh:
            continue
        try:
            distribution = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            pytest.skip(f"{requirement.name} is not installed")
        extras = (known[1] if known else set()) | fresh
        found[name] = (distribution, extras)
        for text in distribution.requires or []:
            dependency = Requirement(text)
            if dependency.marker is None or any(dependency.marker.evaluate({"extra": extra})
                                                for extra in ("", *sorted(extras))):
                pending.append(dependency)
    return found


def test_cuda_12_and_13_extras(project):
    extras = project["optional-dependencies"]
    assert [Requirement(text).extras for text in extras["cuda12"]] == [{"cuda12"}]
    assert [Requirement(text).extras for text in extras["cuda13"]] == [{"cuda13"}]
    assert extras["cuda"] == extras["cuda13"]


def test_a_plain_install_writes_tensorboard_event_files(project):
    names = {canonicalize_name(requirement.name) for requirement in _requirements(project)}
    assert "tensorboardx" in names


def test_every_extra_asked_for_is_provided_under_that_name(project):
    """pip 23.2 matches an extra by its spelling: math-verify[antlr4_13_2] against math-verify's
    'antlr4-13-2' installs without the extra and warns."""
    closure = _closure(_requirements(project, ["test"]))
    missing = [f"{distribution.metadata['Name']}[{extra}]"
               for distribution, extras in closure.values() for extra in sorted(extras)
               if extra not in (distribution.metadata.get_all("Provides-Extra") or [])]
    assert missing == []


def test_lock_pins_exactly_the_test_closure_within_pyproject_bounds(project):
    with open(LOCK) as handle:
        lines = [line.strip() for line in handle if line.strip() and not line.startswith("#")]
    pins = {}
    for line in lines:
        name, separator, version = line.partition("==")
        assert separator and Version(version), line
        pins[canonicalize_name(name)] = Version(version)
    assert len(pins) == len(lines)
    assert sorted(pins) == sorted(_closure(_requirements(project, ["test"])))
    for requirement in _requirements(project, ["test"]):
        assert requirement.specifier.contains(pins[canonicalize_name(requirement.name)]), (
            requirement)
