/**
 * A main-area view of one task's event log, live: the text the events assemble (what the model
 * wrote so far), then the events themselves, folded under a summary line, every event appended
 * as it arrives. The view follows new events (kept scrolled to the end unless the reader
 * scrolled up).
 */

import { Widget } from '@lumino/widgets';

import type { LMSPClient } from './api';
import { TaskFollower } from './sse';
import type { FollowMode } from './sse';
import { stateAfterEvent } from './taskstate';
import type { ITaskEvent } from './types';

/**
 * A one-line summary of an event: its text for deltas (of text, of a call's arguments or of a
 * custom tool's input), the tool and its arguments or input for a call item, the status for
 * lifecycle events.
 */
export function summarize(event: ITaskEvent): string {
  // `Event` is a union discriminated on `type`: each case sees its own event's fields.
  switch (event.type) {
    case 'response.output_text.delta':
    case 'response.reasoning_text.delta':
    case 'response.function_call_arguments.delta':
    case 'response.custom_tool_call_input.delta':
      return JSON.stringify(event.delta);
    case 'response.function_call_arguments.done':
      return `arguments ${event.arguments}`;
    case 'response.custom_tool_call_input.done':
      return `input ${JSON.stringify(event.input)}`;
    case 'response.output_item.added':
    case 'response.output_item.done':
      if (event.item.type === 'function_call') {
        const { name, arguments: args, status } = event.item;
        return `call ${name}(${args}) ${status}`;
      }
      if (event.item.type === 'custom_tool_call') {
        const { name, input, status } = event.item;
        return `call ${name} ${JSON.stringify(input)} ${status}`;
      }
      return '';
  }
  if ('response' in event) {
    return event.response.status;
  }
  if ('error' in event && event.error) {
    return event.error.message;
  }
  return '';
}

export class TaskLogWidget extends Widget {
  private readonly follower: TaskFollower;
  private readonly rows: HTMLTableSectionElement;
  private readonly status: HTMLElement;
  private readonly text: HTMLPreElement;
  private readonly eventsSummary: HTMLElement;
  private state = '…';
  private mode: FollowMode = 'idle';
  private count = 0;

  constructor(client: LMSPClient, readonly taskId: string) {
    super();
    this.id = `jp-lmsp-log-${taskId}`;
    this.title.label = `Events ${taskId.slice(-8)}`;
    this.title.caption = `Event log of task ${taskId}`;
    this.title.closable = true;
    this.addClass('jp-LMSP-log');
    this.node.dataset.taskId = taskId;

    const head = document.createElement('div');
    head.className = 'jp-LMSP-logHead';
    const name = document.createElement('code');
    name.textContent = taskId;
    this.status = document.createElement('span');
    this.status.className = 'jp-LMSP-logStatus';
    head.append(name, this.status);

    const table = document.createElement('table');
    table.className = 'jp-LMSP-logTable';
    const header = table.createTHead().insertRow();
    for (const label of ['#', 'type', 'summary']) {
      const th = document.createElement('th');
      th.textContent = label;
      header.appendChild(th);
    }
    this.rows = table.createTBody();
    this.text = document.createElement('pre');
    this.text.className = 'jp-LMSP-logText';
    const events = document.createElement('details');
    events.className = 'jp-LMSP-logEvents';
    this.eventsSummary = document.createElement('summary');
    events.append(this.eventsSummary, table);
    this.node.append(head, this.text, events);
    this.renderStatus();

    this.follower = new TaskFollower({
      client,
      taskId,
      after: -1,
      onEvent: event => this.append(event),
      onMode: mode => {
        this.mode = mode;
        this.renderStatus();
      },
      onDone: reason => {
        if (reason === 'gone') {
          this.state = 'not found';
          this.renderStatus();
        }
      }
    }).start();
  }

  private append(event: ITaskEvent): void {
    const node = this.node;
    const atEnd = node.scrollTop + node.clientHeight >= node.scrollHeight - 4;
    // The text: deltas appended, a part's done event replaces it, a retry starts over.
    if (event.type === 'response.output_text.delta' && !('choice' in event && event.choice)) {
      this.text.textContent += event.delta;
    } else if (event.type === 'response.output_text.done' && !('choice' in event && event.choice)) {
      this.text.textContent = event.text;
    } else if (event.type === 'response.queued') {
      this.text.textContent = '';
    }
    const row = this.rows.insertRow();
    row.dataset.type = event.type;
    row.title = JSON.stringify(event, null, 2);
    for (const text of [String(event.sequence_number), event.type, summarize(event)]) {
      row.insertCell().textContent = text;
    }
    this.count += 1;
    this.state = stateAfterEvent(event.type) ?? this.state;
    this.renderStatus();
    if (atEnd) {
      node.scrollTop = node.scrollHeight;
    }
  }

  private renderStatus(): void {
    const how =
      this.mode === 'stream'
        ? 'live'
        : this.mode === 'poll'
          ? 'polling'
          : this.mode === 'reconnecting'
            ? 'reconnecting'
            : 'idle';
    this.status.textContent = `${this.state} · ${this.count} events · ${how}`;
    this.eventsSummary.textContent = `${this.count} events`;
    this.node.dataset.state = this.state;
  }

  dispose(): void {
    this.follower.stop();
    super.dispose();
  }
}
