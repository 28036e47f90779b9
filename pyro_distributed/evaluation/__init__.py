"""Work after training, split across workers: the held-out loss
(:mod:`.loss`) and posterior prediction (:mod:`.predictive`)."""
