// k3_oracle_driver: llama.cpp on CPU as the oracle of tests/model/test_k3_oracle.py (built by scripts/k3_oracle.py
// against the llama.cpp that llama-cpp-python 0.3.36 vendors).
//
// For each token-id prompt, in a fresh context: one batch with logits at every position, then greedy decoding
// one token at a time. Flash attention off and an f32 K/V cache (llama.cpp's defaults, FA on and f16 K/V,
// move the tiny model's log-probs by ~1e-2). Log-probs are log_softmax of the f32 logits, computed in double.
//
// usage: k3_oracle_driver MODEL.gguf --prompt ID,ID,... [--prompt ...] [--n-gen N] [--top K] [--threads N]
//                         [--dump-logits PREFIX]
// prints one JSON object on stdout:
//   {"n_vocab": V, "results": [{"prompt": [...],
//      "prompt_logprobs": [log p(prompt[i+1] | prompt[..i]) for i < n-1],
//      "prompt_top": [[[id, logprob] x K] for the same positions],
//      "greedy": [...], "greedy_logprobs": [...], "greedy_top": [[[id, logprob] x K] per generated token]}]}
// --dump-logits PREFIX also writes PREFIX.<p>.f32: raw f32 logits [n_prompt + n_gen - 1, V] of prompt p (the
// rows that predicted every prompt token after the first and every greedy token).
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<llama_token> parse_ids(const std::string & s) {
    std::vector<llama_token> out;
    std::stringstream ss(s);
    std::string tok;
    while (std::getline(ss, tok, ',')) {
        if (!tok.empty()) out.push_back(static_cast<llama_token>(std::stol(tok)));
    }
    return out;
}

struct Row {              // one distribution: the log-probs of the K likeliest tokens, and of a chosen one
    std::vector<std::pair<int, double>> top;
    double chosen = 0.0;
};

Row score(const float * logits, int n_vocab, int chosen, int k) {
    double m = -INFINITY;
    for (int i = 0; i < n_vocab; ++i) m = std::max(m, static_cast<double>(logits[i]));
    double s = 0.0;
    for (int i = 0; i < n_vocab; ++i) s += std::exp(static_cast<double>(logits[i]) - m);
    const double lse = m + std::log(s);
    std::vector<int> idx(n_vocab);
    std::iota(idx.begin(), idx.end(), 0);
    k = std::min(k, n_vocab);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
        return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;   // ties: the lower id first
    });
    Row r;
    for (int j = 0; j < k; ++j) r.top.emplace_back(idx[j], static_cast<double>(logits[idx[j]]) - lse);
    r.chosen = chosen >= 0 ? static_cast<double>(logits[chosen]) - lse : 0.0;
    return r;
}

int argmax(const float * x, int n) {
    int b = 0;
    for (int i = 1; i < n; ++i) if (x[i] > x[b]) b = i;
    return b;
}

void print_ints(const std::vector<int> & v) {
    printf("[");
    for (size_t i = 0; i < v.size(); ++i) printf("%s%d", i ? ", " : "", v[i]);
    printf("]");
}

void print_rows(const std::vector<Row> & rows, bool chosen) {
    printf("[");
    for (size_t i = 0; i < rows.size(); ++i) {
        printf("%s", i ? ", " : "");
        if (chosen) {
            printf("%.9g", rows[i].chosen);
            continue;
        }
        printf("[");
        for (size_t j = 0; j < rows[i].top.size(); ++j)
            printf("%s[%d, %.9g]", j ? ", " : "", rows[i].top[j].first, rows[i].top[j].second);
        printf("]");
    }
    printf("]");
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf --prompt ID,ID,... [--prompt ...] [--n-gen N] [--top K] "
                        "[--threads N] [--dump-logits PREFIX]\n", argv[0]);
        return 2;
    }
    const std::string model_path = argv[1];
    std::vector<std::vector<llama_token>> prompts;
    int n_gen = 16, top_k = 5, threads = 2;
    std::string dump;
    for (int i = 2; i < argc; ++i) {
        const std::string a = argv[i];
        const bool has_value = i + 1 < argc;
        if (a == "--prompt" && has_value) prompts.push_back(parse_ids(argv[++i]));
        else if (a == "--n-gen" && has_value) n_gen = atoi(argv[++i]);
        else if (a == "--top" && has_value) top_k = atoi(argv[++i]);
        else if (a == "--threads" && has_value) threads = atoi(argv[++i]);
        else if (a == "--dump-logits" && has_value) dump = argv[++i];
        else { fprintf(stderr, "unknown or incomplete argument: %s\n", a.c_str()); return 2; }
    }
    if (prompts.empty()) { fprintf(stderr, "no --prompt given\n"); return 2; }
    for (const auto & p : prompts) if (p.empty()) { fprintf(stderr, "empty prompt\n"); return 2; }

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", model_path.c_str()); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    printf("{\"n_vocab\": %d, \"results\": [", n_vocab);
    for (size_t p = 0; p < prompts.size(); ++p) {
        const std::vector<llama_token> & prompt = prompts[p];
        const int n_prompt = static_cast<int>(prompt.size());
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = n_prompt + n_gen + 8;
        cp.n_batch = std::max(n_prompt, 32);
        cp.n_ubatch = cp.n_batch;                 // the whole prompt in one ubatch
        cp.n_seq_max = 1;
        cp.n_threads = threads;
        cp.n_threads_batch = threads;
        cp.type_k = GGML_TYPE_F32;
        cp.type_v = GGML_TYPE_F32;
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
        cp.no_perf = true;
        llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }

        llama_batch batch = llama_batch_init(n_prompt, 0, 1);
        for (int i = 0; i < n_prompt; ++i) {
            batch.token[i] = prompt[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        batch.n_tokens = n_prompt;
        if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode(prompt) failed\n"); return 1; }

        std::vector<float> logits_dump;
        std::vector<Row> prompt_rows;
        for (int i = 0; i + 1 < n_prompt; ++i) {
            const float * l = llama_get_logits_ith(ctx, i);
            prompt_rows.push_back(score(l, n_vocab, prompt[i + 1], top_k));
            if (!dump.empty()) logits_dump.insert(logits_dump.end(), l, l + n_vocab);
        }
        const float * last = llama_get_logits_ith(ctx, n_prompt - 1);
        std::vector<float> cur(last, last + n_vocab);
        std::vector<int> greedy;
        std::vector<Row> gen_rows;
        llama_batch one = llama_batch_init(1, 0, 1);
        for (int t = 0; t < n_gen; ++t) {
            const int id = argmax(cur.data(), n_vocab);
            greedy.push_back(id);
            gen_rows.push_back(score(cur.data(), n_vocab, id, top_k));
            if (!dump.empty()) logits_dump.insert(logits_dump.end(), cur.begin(), cur.end());
            if (t + 1 == n_gen) break;
            one.token[0] = id;
            one.pos[0] = n_prompt + t;
            one.n_seq_id[0] = 1;
            one.seq_id[0][0] = 0;
            one.logits[0] = 1;
            one.n_tokens = 1;
            if (llama_decode(ctx, one) != 0) { fprintf(stderr, "decode(token %d) failed\n", t); return 1; }
            const float * l = llama_get_logits_ith(ctx, 0);
            cur.assign(l, l + n_vocab);
        }
        if (!dump.empty()) {
            const std::string path = dump + "." + std::to_string(p) + ".f32";
            FILE * f = fopen(path.c_str(), "wb");
            if (!f || fwrite(logits_dump.data(), sizeof(float), logits_dump.size(), f) != logits_dump.size()) {
                fprintf(stderr, "cannot write %s\n", path.c_str());
                return 1;
            }
            fclose(f);
        }
        printf("%s\n {\"prompt\": ", p ? "," : "");
        print_ints(std::vector<int>(prompt.begin(), prompt.end()));
        printf(",\n  \"prompt_logprobs\": ");
        print_rows(prompt_rows, true);
        printf(",\n  \"prompt_top\": ");
        print_rows(prompt_rows, false);
        printf(",\n  \"greedy\": ");
        print_ints(greedy);
        printf(",\n  \"greedy_logprobs\": ");
        print_rows(gen_rows, true);
        printf(",\n  \"greedy_top\": ");
        print_rows(gen_rows, false);
        printf("}");
        llama_batch_free(batch);
        llama_batch_free(one);
        llama_free(ctx);
    }
    printf("]}\n");
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
