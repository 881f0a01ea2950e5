"""The ``acme`` target: which devices it claims, and what it knows about them."""

from __future__ import annotations

import torch

from tileops.backend import DeviceFacts, register_detector, register_device_facts

TARGET = "acme"
DEVICE_TYPE = "acme"


def claims(device: torch.device) -> bool:
    """True for the devices this backend serves. Keep it cheap and never raise."""
    return device.type == DEVICE_TYPE


def device_facts(device: torch.device) -> DeviceFacts:
    """What selection may know about an acme device. A real backend asks its runtime."""
    return DeviceFacts(device_type=DEVICE_TYPE, arch=1, sm_count=1, name="Acme reference device")


register_detector(target=TARGET, detect=claims)
register_device_facts(DEVICE_TYPE, device_facts)
