"""LM Studio's list of its models, the state its telemetry reads."""

import pytest

from proxy.servers.lmstudio import loaded_models


def test_the_loaded_models_are_those_whose_state_says_so() -> None:
    listing = {"object": "list", "data": [{"id": "a", "state": "loaded"}, {"id": "b", "state": "not-loaded"},
                                          {"id": 7, "state": "loaded"}]}
    assert loaded_models(listing) == ("a",)
    assert loaded_models({"data": []}) == ()


@pytest.mark.parametrize("listing", [{"data": "x"}, [], {"data": [1]}, {"data": [{"id": "a"}]}])
def test_another_shape_is_refused(listing: object) -> None:
    with pytest.raises(ValueError):
        loaded_models(listing)
