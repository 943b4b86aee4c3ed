"""Account: the single annotation pass (cost, owner forward node, phase, module and kind of every node) and the
frozen Accounting with its one inclusive module roll-up."""
