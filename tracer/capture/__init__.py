"""Recording a run: module hooks, the noise samples of a reference, re-synchronisation, optimizer state."""
