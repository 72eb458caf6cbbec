"""`hydra/sweeper=dsexp_budget` (dsexp's default): Hydra's basic sweeper, or with budget.* set, the budget search;
its logic lives in dsexp.compose.budget.sweeper. Hydra instantiates only classes defined inside `hydra_plugins`,
hence the (empty) subclass here."""

from dsexp.compose.budget import sweeper as _impl


class DsexpBudgetSweeper(_impl.BudgetSweeper):
    """The sweep's dimensions as a space, the batch searched in each configuration, within budget.*."""
