import pytest
import torch


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)
