/* anneal data layer: tokenizer (encode, decode, train), token shards, loader. */
#ifndef ANNEAL_DATA_H
#define ANNEAL_DATA_H

#include "anneal/loader.h"
#include "anneal/shard.h"
#include "anneal/prepare.h"
#include "anneal/tokenizer.h"

#endif
