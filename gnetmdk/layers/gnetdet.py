"""Former location of GNetDet, kept while older imports are moved: gnetmdk.models.gnetdet.model."""
from gnetmdk.models.gnetdet.model import *  # noqa: F401,F403
from gnetmdk.models.gnetdet.model import GNetDet, Sublayer  # noqa: F401
