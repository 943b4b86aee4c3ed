"""Trace: the fake-tensor capture of forward, loss, backward and optimizer step as typed records and one torch.fx graph;
block replay, module hooks, aliasing (view vs copy from the schema), and the one module that touches private torch APIs."""
