"""The models a run trains: the zoo (torchvision classifiers, built-in test nets, a user's builder) and the split into pipeline stages."""
