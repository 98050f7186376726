"""Stand-in for torchvision, pinned to what SGLang 0.5.23 imports. PyPI's torchvision is a
CUDA build that fails beside torch's CPU build (`operator torchvision::nms does not
exist`); SGLang imports it at start-up for vision models' preprocessing, which a text
model never runs."""

from placeholder import stand_in

stand_in(__name__, "0.29.1")
