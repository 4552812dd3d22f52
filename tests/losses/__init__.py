"""Tests of the loss-Hessian roots (``vivit/losses.py``), alone and end to end."""
