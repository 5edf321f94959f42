"""apex.optimizers (apex/optimizers/__init__.py): the two megatron-core imports, FusedSGD and
FusedAdam. The other fused optimizers Apex ships (NovoGrad, LAMB, Adagrad) are not modelled: an
import of one fails."""

from apex.optimizers.fused_adam import FusedAdam
from apex.optimizers.fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD"]
