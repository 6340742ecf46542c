"""Which folder an export may replace: a search replaces only its own earlier export (the same
study in the same storage), never a policy exported by hand or by a search elsewhere."""

from __future__ import annotations

import pytest

from autoscale.errors import ConfigError
from autoscale.search.export import SEARCH_EXPORT, check_export_target, export_parametric

STUDY, HERE, ELSEWHERE = "mlp-bad-batches-parametric", "sqlite:///a.db", "sqlite:///b.db"


def _export(root, name, **workload):
    export_parametric("torch", {"growth_interval": 7}, name, workload=workload, out_dir=root)


@pytest.mark.parametrize(
    "workload, storage",
    [
        ({"exported_by": SEARCH_EXPORT}, HERE),
        ({"exported_by": SEARCH_EXPORT}, "a.db"),  # the same file, spelt another way
        # an earlier autoscale's search export: no exported_by, but what it searched on
        ({"searched_on": "replay of recorded real steps"}, HERE),
    ],
    ids=["marked", "spelt-otherwise", "earlier-version"],
)
def test_a_search_replaces_its_own_export_of_the_same_study_and_storage(
    tmp_path, monkeypatch, workload, storage
):
    monkeypatch.chdir(tmp_path)
    _export(tmp_path, "mine", study=STUDY, storage=HERE, **workload)
    assert check_export_target("mine", tmp_path, STUDY, False, storage=storage)


@pytest.mark.parametrize(
    "workload, held",
    [
        # the same study name in another storage: another search's pick
        (
            {"study": STUDY, "storage": ELSEWHERE, "exported_by": SEARCH_EXPORT},
            f"the export of a study '{STUDY}' in {ELSEWHERE}",
        ),
        # a trial exported by hand from this very study: the user's pick
        (
            {"study": STUDY, "storage": HERE, "exported_by": "autoscale export"},
            f"a trial of study '{STUDY}' exported by hand",
        ),
        # neither says who made it nor what it searched on
        ({"study": STUDY, "storage": HERE}, "that does not say a search made it"),
        # an earlier records search's export: no storage named
        ({"study": STUDY, "validated_on": "replay"}, "that does not name its storage"),
        # another study's policy
        (
            {"study": "another", "storage": HERE, "exported_by": SEARCH_EXPORT},
            f"the export of study 'another' in {HERE}, not of study '{STUDY}'",
        ),
    ],
    ids=["other-storage", "by-hand", "unmarked", "no-storage", "other-study"],
)
def test_a_search_never_replaces_a_policy_it_did_not_export(tmp_path, workload, held):
    _export(tmp_path, "keepme", **workload)
    with pytest.raises(ConfigError, match="'.*keepme' already exists and holds") as err:
        check_export_target("keepme", tmp_path, STUDY, False, storage=HERE)
    assert held in str(err.value) and str(err.value).endswith(
        "choose another name (--export NAME) or pass --force"
    )
    assert check_export_target("keepme", tmp_path, STUDY, True, storage=HERE)  # --force may
