"""placeholder during first build"""
from . import _core
