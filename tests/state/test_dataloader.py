"""The elastic position holder's contract (state/dataloader.py): ``data/`` and ``state/`` do not
import each other, so the typing Protocols are the only link between the restore and the
classes in ``data/``; these tests keep the two in step."""

from __future__ import annotations

import inspect

import pytest

from goodput_ckpt.data import ElasticSampler, TokenStream
from goodput_ckpt.state.dataloader import (
    AdoptsSavedEpoch,
    ChecksSavedState,
    ElasticPositionHolder,
    PreparesElasticResume,
    elastic_sampler_of,
)


@pytest.mark.parametrize("holder", [ElasticSampler, TokenStream])
def test_the_data_position_holders_meet_the_protocols_the_restore_uses(holder):
    for protocol in (ElasticPositionHolder, PreparesElasticResume, ChecksSavedState):
        assert issubclass(holder, protocol), f"{holder.__name__} no longer meets {protocol.__name__}"
        for name in (n for n in vars(protocol) if not n.startswith("_")):
            want = set(inspect.signature(getattr(protocol, name)).parameters)
            got = set(inspect.signature(getattr(holder, name)).parameters)
            assert want <= got, f"{holder.__name__}.{name} lacks {sorted(want - got)}"
    assert issubclass(ElasticSampler, AdoptsSavedEpoch)


class _Resumes:
    def elastic_resume(self, loader_states, *, batch_size, where="checkpoint"):
        return "resumed"


class _NotCallable:
    elastic_resume = None


class _Loader:
    def __init__(self, sampler=None, batch_sampler=None, dataset=None):
        self.sampler, self.batch_sampler, self.dataset = sampler, batch_sampler, dataset


def test_the_holder_is_found_on_the_sampler_the_batch_sampler_or_the_dataset_in_that_order():
    first, second = _Resumes(), _Resumes()
    assert elastic_sampler_of(_Loader(sampler=first, dataset=second)) is first
    assert elastic_sampler_of(_Loader(batch_sampler=_Loader(sampler=first), dataset=second)) is first
    assert elastic_sampler_of(_Loader(sampler=object(), dataset=second)) is second
    assert isinstance(elastic_sampler_of(_Loader(dataset=second)), ElasticPositionHolder)


def test_a_loader_without_a_callable_elastic_resume_has_no_holder():
    assert elastic_sampler_of(_Loader(sampler=_NotCallable(), dataset=object())) is None
    assert elastic_sampler_of(object()) is None
    assert not isinstance(_Resumes(), PreparesElasticResume)  # optional: the restore falls back
