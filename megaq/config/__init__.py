"""The typed configuration of a run, lowest module first:

    flags.py           flag()/switch(): a dataclass field that is also a command-line flag
                       (imports nothing of megaq, so config classes at every layer use it)
    run.py             RunConfig and the Training/Optimizer/Checkpoint/Logging configs
    megatron_flag_list.py  every flag of Megatron-LM's parser, as recorded
    megatron_flags.py  the rest of Megatron-LM's flags: aliases, accepted with a note, or refused
    deepspeed_config.py  --deepspeed-config: a DeepSpeed ds_config read as the flags above
    arguments.py       the parser, generated from the config classes -> one RunConfig

This file imports nothing, on purpose: the model, parallel, zero and data layers import
megaq.config.flags to declare their fields, and run.py imports those layers' config
classes. Re-exporting run.py here would make importing megaq.config.flags (from
megaq.zero.config, say) import RunConfig and with it the layers above, in a circle.
Import the module that holds the name: ``from megaq.config.run import RunConfig``.
"""
