"""The data a run reads: data sets (synthetic, image folders, CIFAR-10, a user's builder) and the on-device input pipeline."""
