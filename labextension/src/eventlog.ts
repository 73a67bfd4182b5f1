/** A main-area view of one task's event log, live: every event appended as it arrives. */

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
    this.node.append(head, table);
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
    const row = this.rows.insertRow();
    row.dataset.type = event.type;
    row.title = JSON.stringify(event, null, 2);
    for (const text of [String(event.sequence_number), event.type, summarize(event)]) {
      row.insertCell().textContent = text;
    }
    this.count += 1;
    this.state = stateAfterEvent(event.type) ?? this.state;
    this.renderStatus();
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
    this.node.dataset.state = this.state;
  }

  dispose(): void {
    this.follower.stop();
    super.dispose();
  }
}
