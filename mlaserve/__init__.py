"""mlaserve's command line (`mlaserve serve | generate | make-checkpoint`): the top of the layers."""
