"""What a SelfAttention call is: its checks, its masks, its implementation,
its output spec."""

from __future__ import annotations

import keras
from keras import ops

from keras_selfattn import _config, _inputs, _score_weights
from keras_selfattn.attention import Masks, choose
from keras_selfattn.attention import cache as cache_lib
from keras_selfattn.attention.fused import on_gpu


class CallPlan:
    """SelfAttention's methods that describe a call before computing it (a
    base class of it, before `keras.layers.Layer`)."""

    def _masks(self, mask, attention_mask, query_offset=None, segments=None) -> Masks:
        return Masks(
            key_padding=mask,
            attention=attention_mask,
            causal=self.causal,
            sliding_window=self.sliding_window,
            query_offset=query_offset,
            segments=segments,
        )

    def implementation(
        self,
        inputs,
        mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores: bool = False,
        cache=None,
        cache_update_index=None,
        attention_bias=None,
        segment_ids=None,
    ) -> str:
        """The name of the implementation a call with these arguments takes:
        "fused", "single_query", "packed", "chunked" or "explicit" (see
        docs/attention-paths.md).

        A call with `segment_ids` takes "packed" (blocks that skip the keys
        of other segments) with `chunk_size`, and without it (the default)
        on a CPU when its rows have at least 256 positions, known while
        tracing: blocks of the power of two nearest the cube root of 256
        times the row's length (64 positions for rows of 512 to 2048, 128
        from 4096 to 16384). Shorter rows, and rows of a length known only
        at run time, attend whole (fused or explicit), which is faster there.
        Training takes "packed" only where its gradient differentiates no
        loop over key blocks (else "chunked" with `chunk_size`, the fused or
        explicit path without).

        Raises:
            ValueError: the one the call would raise (checked alike, built or
                not): bad `inputs`, masks or request, or `flash_attention=True`
                and the call cannot use the fused kernel.
        """
        # The call's checks, in its order: `__call__`'s, `build`'s, `call`'s.
        input_dim = None if self._dims is None else self._dims.input_dim
        _inputs.check(self.name, inputs, input_dim)
        dims = self._dims or _config.dims(self, inputs.shape[-1])
        offset = self._decoding(
            inputs,
            mask,
            attention_mask,
            return_attention_scores,
            cache,
            cache_update_index,
            attention_bias,
            segment_ids,
        )
        masks = self._masks(mask, attention_mask, offset, segment_ids)
        inputs = ops.convert_to_tensor(inputs)
        mods = _score_weights.names_for_call(self, attention_bias)
        return self._choose(
            inputs, masks, training, return_attention_scores, mods, dims
        ).name

    def _choose(
        self,
        inputs,
        masks: Masks,
        training,
        return_scores: bool,
        mods,
        dims=None,
        time_major_cache: bool = False,
    ):
        dims = dims or self._dims
        return choose(
            masks,
            query_on_gpu=on_gpu(inputs),
            # A plain bool: a symbolic size (torch.export's) would make a
            # symbolic one, which the facts' cache would have to evaluate.
            single_query=type(inputs.shape[1]) is int and inputs.shape[1] == 1,
            same_head_dims=dims.key_dim == dims.value_dim,
            dtype=self.compute_dtype,
            flash_attention=self.flash_attention,
            chunk_size=self.chunk_size,
            dropout=self.seed_generator is not None and bool(training),
            training=bool(training),
            return_weights=return_scores,
            score_mods=mods,
            time=inputs.shape[1] if type(inputs.shape[1]) is int else None,
            time_major_cache=time_major_cache,
            layer_name=self.name,
        )

    def _decoding(
        self,
        inputs,
        mask,
        attention_mask,
        return_attention_scores,
        cache,
        index,
        attention_bias=None,
        segment_ids=None,
    ):
        """Raises the call's ValueErrors; returns None without a cache (a
        tensor or a `cache_lib.Cache`), else `index` converted
        (`cache_lib.index_of`): the call reads it once (an eager tensor's
        value waits for the device)."""
        if cache is None:
            cache_lib.check_no_index(index, self.name)
            _inputs.check_masks(self.name, inputs.shape, mask, attention_mask)
            _inputs.check_scores_request(
                self.name, self.chunk_size, return_attention_scores
            )
            _inputs.check_score_inputs(
                self.name, inputs.shape, self.num_heads, attention_bias, segment_ids
            )
            return None
        cache = cache_lib.wrapped(cache)
        _inputs.check_decoding_scores(
            self.name, inputs.shape, self.num_heads, cache, attention_bias, segment_ids
        )
        index = cache_lib.check_call(
            self, inputs, cache, index, attention_mask, return_attention_scores
        )
        _inputs.check_decoding_mask(self.name, inputs, cache.max_length, mask)
        return index

    def compute_output_spec(
        self,
        inputs,
        mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores: bool = False,
        cache=None,
        cache_update_index=None,
        attention_bias=None,
        segment_ids=None,
    ):
        # `__call__` has checked `inputs`, and built the layer.
        self._decoding(
            inputs,
            mask,
            attention_mask,
            return_attention_scores,
            cache,
            cache_update_index,
            attention_bias,
            segment_ids,
        )
        output = keras.KerasTensor(
            tuple(inputs.shape[:-1]) + (self._dims.output_width,),
            dtype=self.compute_dtype,
        )
        if cache is not None:
            return output, keras.KerasTensor(cache.shape, dtype=cache.dtype)
        if not return_attention_scores:
            return output
        batch, time = inputs.shape[0], inputs.shape[1]
        weights = keras.KerasTensor(
            (batch, self.num_heads, time, time), dtype=self.compute_dtype
        )
        return output, weights
